"""Runner-independent speculative-decoding logic (imports no runner module)."""
