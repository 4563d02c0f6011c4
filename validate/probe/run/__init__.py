"""Running probes and judging their outputs: the run itself, attention implementations, the
fp32 probe session, the parity metrics and the thresholds they are judged by."""
