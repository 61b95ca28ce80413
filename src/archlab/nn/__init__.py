"""Interchangeable building blocks, one file per concern, each a small registry."""
