"""Models and their loaders: the one Llama definition (training, serving, RLHF), GGUF and HF loaders,
the tokenizer with its chat template, and attention through a paged KV cache. Import the submodule you
need (`mlsyslab.nn.llama`, ...): this package imports nothing itself, so the tokenizer and the model
resolver (`nn.pretrained`) load without torch (the server's HTTP process never imports it)."""
