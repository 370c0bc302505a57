"""Built-in weight quantizers: int8 and int4 weight-only (plain rounding and GPTQ), and fp8 e4m3."""
