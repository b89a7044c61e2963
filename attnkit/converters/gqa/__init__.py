"""`attnkit convert --to gqa`: fewer KV heads (GQA/MQA) in the source's own architecture."""
