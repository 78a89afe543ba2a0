"""Inference: decoding with a KV cache (greedy, sampling, beam), the text it streams, and
`models.load`, a model that generates and scores text."""
