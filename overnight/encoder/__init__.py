"""The encoder engine: encoder-only models (BERT) behind the same EngineClient as the decoder engine.

batching.py  waiting prompts, taken in batches of similar lengths (little padding)
runner.py    one batch through the model: packed inputs, forward, pooling, head, to the host
engine.py    EncoderEngine: the EngineClient the entry points drive
"""
