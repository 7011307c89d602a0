"""Generated from proto/kvkeep/v1/kvkeep.proto by tools/generate_stubs.py.

Do not edit: regenerate (tests/test_stubs.py fails when these are stale).
"""
