"""The streaming engine: `engine.stream_layers` walks a source's decoder layers one at a time, and
`rowstore.RowStore` keeps the hidden-state streams it advances (calibration and held-out rows) in
scratch files. Import the modules themselves: this package imports nothing, so that the source reader
(`mla/source.py`) and the engine can both use the streams without an import cycle.
"""
