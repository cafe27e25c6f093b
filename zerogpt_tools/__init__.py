"""Command-line tools around a zerogpt run: export (to Hugging Face), generate, estimate, extend_vocab.

They live outside `zerogpt` because they may import all three packages (zerogpt, model_zoo, data_pipeline),
so each shared helper (tokenizer loading, size parsing, model sizes, FLOPs) exists once.
"""
