"""`archlab demo`: the whole pipeline on built-in data, and the stages the demos share."""
