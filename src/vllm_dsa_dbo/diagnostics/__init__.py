"""What the fix reports and refuses; nothing here changes how a model runs.

`refusals`: the load-time refusal walk; `startup`: the line a worker logs;
`groups` and `accounting`: what a built model's index groups share and the
bytes the fix allocates; `layout`: leaders, followers and copies per vLLM code
path, for `memory`; `isolation`: the opt-in microbatch isolation checker.
"""
