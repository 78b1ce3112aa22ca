"""Drop-in entry points for code written against other attention libraries (above ``api``)."""
