"""The executors of :func:`linattn.linear_attention`: one module each, one signature.

Each module has ``run(call, plan, attend) -> (output, state or None)``: it checks the
call as every executor does (:mod:`linattn.executors.plain` or
:mod:`linattn.executors.parts`), runs it on its path and returns the output in the
caller's dtype.  Only :mod:`linattn._plan` chooses among them and imports them.
"""
