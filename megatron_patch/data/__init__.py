"""Data: JSONL -> `.bin/.idx` (`preprocess`), a built-in corpus (`corpus`), tokenizer training on a corpus
(`train_tokenizer`), sentence splitting (`sentences`) and megatron-core GPT/BERT datasets over the files
(`datasets`).

    python toolkits/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus ...
"""
