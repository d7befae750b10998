"""Tokenize JSONL into Megatron `.bin/.idx` files, with Megatron-LM's `tools/preprocess_data.py` flags.

    python toolkits/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 8
"""

import sys

from megatron_patch.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
