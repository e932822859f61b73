"""Files on disk: where weights live, and the formats minillm reads and writes.

    weights.py        model names, the weights directory, downloads (and a GGUF's conversion, cached)
    gguf_convert.py   GGUF file -> Hugging Face folder (dequantised)
    gguf_export.py    a model as an F32 GGUF file, for llama.cpp
    chat_template.py  a checkpoint's Jinja chat template, rendered as transformers renders it
    trace_events.py   Chrome's Trace Event Format: events, validation, the JSON file Perfetto opens
"""
