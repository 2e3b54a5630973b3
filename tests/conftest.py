# tests/ is put on sys.path by this file's presence, so tests import `reference`.
