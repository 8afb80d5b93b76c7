"""The request-level vocabulary every floor shares and the router needs without torch: sampling
parameters and request limits, chat rendering, the tokenizer, prefix-cache keys. Imports nothing of
pdserve and no tensor library."""
