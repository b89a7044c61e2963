"""Checkpoint I/O, shared by every method and knowing none of them: model resolution (`resolve`),
a lazy safetensors reader, a streaming sharded writer and atomic output folders (`checkpoint`),
row reads and embedding lookups (`tensor_rows`), scratch files of hidden states (`rowstore`),
tensor copies between checkpoints (`stream_copy`) and the Hub (`hub`). The model card is
`attnkit.card` (`model_card` here only forwards `write_model_card`). Nothing here imports from
`attnkit.converters`."""
