"""Pure-torch reference implementations: the oracle, and the CPU backend.

:mod:`.attention` (M1c, M1b, cache write) accumulates in float64;
:mod:`.mxfp4` (MXFP4 format, bmm_a16wfp4, M1a) in float32 on exactly
dequantized weights. Both run on any device.
"""
