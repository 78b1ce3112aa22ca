"""The tokenizer of a GGUF model: transformers builds it from the file's own vocabulary, merges
and chat template (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``)."""

from __future__ import annotations


def load_tokenizer(gguf_path):
    """A fast tokenizer built by transformers from the GGUF at ``gguf_path`` (a Path)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode(tokenizer, text: str, chat: bool | None = None) -> list[int]:
    """Token ids of ``text``: as one user turn of the chat template (with the generation
    prompt) when ``chat``, raw otherwise; ``chat=None`` uses the template when the tokenizer
    has one."""
    if chat is None:
        chat = has_chat_template(tokenizer)
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns an encoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text)["input_ids"]]


def eos_ids(tokenizer, cfg) -> list[int]:
    """The end-of-sequence ids of the tokenizer and of the model config."""
    ids = {cfg.eos_token_id, tokenizer.eos_token_id}
    return sorted(int(i) for i in ids if i is not None)
