"""The ground floor every layer stands on: errors, the dtype table, the name matcher, the
nested-value walker, folding, progress, the Ctrl-C record, the Hub client, the version.

Its modules import nothing else of this project, nor each other (docs/architecture.md).
"""
