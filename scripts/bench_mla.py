"""The MLA lab (issue 47's rows beside FlashInfer's MLA wrapper): see
:mod:`pagedattn.bench.mla`.

    PYTHONPATH=src python3 scripts/bench_mla.py [--rows ...] [--json F]
    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/bench_mla.py --dry-run   # CPU
"""

import sys

from pagedattn.bench.mla import main

if __name__ == "__main__":
    sys.exit(main())
