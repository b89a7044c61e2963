"""Checkpoint I/O, shared by every method and knowing none of them: model resolution (`resolve`),
a lazy safetensors reader, a streaming sharded writer and atomic output folders (`checkpoint`),
row reads and embedding lookups (`tensor_rows`), scratch files of hidden states (`rowstore`),
tensor copies between checkpoints (`stream_copy`), the Hub (`hub`) and the model card
(`model_card`). Nothing here imports from `attnkit.converters`."""
