"""kvoffload: the ``kvoffload`` command (one CLI with subcommands) over the monorepo's packages.

One concept per module:

- ``cli``                the parser and the dispatch of ``kvoffload COMMAND``; each group's code in
                         ``cli_bench`` (bench: run, JSON, verdict), ``cli_model`` (model init / fetch),
                         ``cli_trace`` (trace record / show), ``cli_plan`` (plan), ``cli_stack`` (up, demo).
- ``plan_sizing``        ``kvoffload plan``'s report: a deployment sized from a config.json and each
                         node's JSON (buffer plan, device and host bytes, config validation).

The benches are ``kvoffload_bench``'s; the stacks ``up`` and ``demo`` run, the fault suite
(``bench faults``) and ``model fetch``'s body are ``kvoffload_testing``'s.
"""

__version__ = "0.1.0"
