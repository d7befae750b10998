"""Train a GPT-2 BPE, WordPiece, SentencePiece or HuggingFace tokenizer from JSONL, offline.

    python toolkits/train_tokenizer.py --kind gpt2-bpe --input stdlib.jsonl --output-dir tok --vocab-size 8000
"""

import sys

from megatron_patch.data.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
