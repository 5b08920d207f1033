"""What the fix reports and refuses; none of it changes how a model runs.

`groups`: what a built model's index groups share; `accounting`: bytes;
"""
