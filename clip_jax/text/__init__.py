"""A model's text, read as token ids: CLIP's BPE (`clip_tokenizer`, OpenAI's vocabulary shipped here), the SigLIP
and SigLIP 2 SentencePiece tokenizers read from a model's own files (`sentencepiece_tokenizer`), and the choice a
model's config makes between them (`model_tokenizer.tokenizer_for`). Nothing is imported here, so that a data
worker's `import clip_jax.text.clip_tokenizer` stays light."""
