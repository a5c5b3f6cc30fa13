"""QuantizedKVCache: a transformers Cache holding keys and values as packed low-bit codes, in the style of KVQuant.

- Keys per channel, before rotary embedding: RoPE is undone on arrival and redone after dequantization, because
  keys have fixed outlier channels that rotation would smear across pairs. By default keys are coded in blocks of
  `key_block` positions, each channel on the block's own range within the calibrated one (`key_blocks.py`);
  with `key_block=0` each key is coded on arrival on its (head, channel) range, calibrated offline (`KeyRanges`)
  or tracked online with an EMA observer, as in KVQuant.
- Values per token, with a dynamic range per (token, head).
- Dense-and-sparse: the `outliers` share of each head vector that lies furthest out is kept apart in fp16 with
  its index; the dense rest is quantized on the tighter range.
- Compact side information (`compact`): the same, in fewer bytes: block range ends in 6 bits, kept key channels in
  8-bit codes, value outliers in int8 steps, and each value vector's range searched among clipped ones.
- Attention sinks: the first `sinks` tokens are kept unquantized, in 16 bits (the model's dtype when it has 16 bits,
  fp16 otherwise: the precision of the fp16 cache the quantized one is measured against).

Every update returns the dequantized keys and values, so the quantization error reaches attention: evaluation
through this cache measures what a quantized cache costs.

Modules: `config.py` (KVQuantConfig, its defaults per bit width), `calibration.py` (key ranges: calibrated
`KeyRanges`, or measured online), `coding.py` (quantizing and dequantizing keys and values, outliers, the pre-RoPE
rotations), `key_blocks.py` (keys coded in blocks of positions), `layout.py` (one layer's stores: sinks, appending,
reading back) and `cache.py` (the transformers Cache, and KVCacheSpec that builds it for a model).
"""
