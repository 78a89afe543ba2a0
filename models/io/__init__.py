"""Files in and out: Hugging Face folders (config, weights, tokenizer, chat template),
sharded weights, the export of a run as a Hugging Face folder or PEFT adapters, a
command's SOURCE, and files written whole."""
