"""Training: the typed run configuration (``config``, parsed by ``arguments``), the ``Engine``, the trainer
templates (``trainers``: the loop and the hooks) over two backends (``backends``: megatron-core and plain
torch/Hugging Face, saving and loading through ``megatron_patch.checkpoint``), GPT and BERT trainers and tasks, and
the ``rapidformer`` launcher.

Example::

    rapidformer --task pretraining --model-name tiny-llama --tokenizer-type GPT2BPETokenizer ... --train-iters 100
"""
