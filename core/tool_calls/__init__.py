"""Tool calls out of a model's reply text: one streaming parser (stream.py) and a format each (hermes.py,
qwen3_xml.py; reader.py picks one). Pure Python: the ingress formats replies with it, the replica keys a
finished tool turn for retention with the same code."""
