"""The engine: the one host core of decoding (``core``: slots, pages, admission, prefill
shapes, rounds, finishes) and its offline driver (``offline.Runner``); the serving engine
(``serve.engine.Engine``) drives the same core from its own thread."""
