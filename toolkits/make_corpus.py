"""Write the Python standard library's source files as a JSONL corpus (no download needed).

    python toolkits/make_corpus.py --output stdlib.jsonl --max-mb 30
"""

import sys

from megatron_patch.data.corpus import main

if __name__ == "__main__":
    sys.exit(main())
