"""The JSON Schemas of precision-convert's JSON documents (see docs/json-schema.md).

pyproject installs this folder as ``precision_convert.schema``, so the files documented here are
the very ones certificates are checked against when they are read back; this file only makes
the folder a package that an editable install can find.
"""
