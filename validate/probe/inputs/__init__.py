"""What probes feed a model: seeded input layouts, coverage sweeps and their probe families,
the model's tokenizer, and the user's own data, read and checked up front."""
