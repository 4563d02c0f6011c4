"""Calibrated plans: the fp32 session's activations turned into islands, then the fp16
candidate search that checks them as users load them."""
