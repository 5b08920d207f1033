"""What the fix reports and refuses; nothing here changes how a model runs.

`load_check`: the patch that runs `refusals`' walk over each built model, else logs
`startup`'s line; `layout`: leaders, followers and what is kept per vLLM code path, for
`memory`; `isolation`: the opt-in microbatch isolation checker.
"""
