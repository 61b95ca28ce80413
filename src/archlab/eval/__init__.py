"""Evaluation: validation loss and bits per byte, lm-eval, diagnostics of a trained model, fill-mask."""
