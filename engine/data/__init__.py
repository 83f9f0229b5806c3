"""Bring-your-own data: load rows through the `datasets` library (load.py), recognise their
layout (formats.py), turn prompts into token ids (prompts.py) and fingerprint the source so a
resumed run trains on the same data (fingerprint.py)."""
