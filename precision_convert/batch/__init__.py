"""Batch conversion: a manifest of models × targets, one job per pair, resumable.

``precision-convert batch MANIFEST`` reads the manifest (:mod:`.manifest`, all of it checked
before anything runs), plans each job's start from its state (:mod:`.state`), and runs the jobs
(:mod:`.job`: download → convert → validate → push) in warm local workers (:mod:`.local`) or
as Ray tasks (:mod:`.ray_cluster`); :mod:`.runner` ties them together and writes the report,
:mod:`.etiquette` keeps pushes polite to the Hub.

This layer sits between the CLI and the api: it calls ``convert``, ``validate`` and the Hub
gate like the ``model`` command does, and owns only its worker processes.
"""
