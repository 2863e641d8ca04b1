"""Training (Zoo models, drafters, CASCADE re-weighting). Imports the runtime; never imported by it."""
