"""The test-only switch that makes a worker fail on purpose (the test_crash setting, marked for
tests in config.SETTINGS), in a module of its own: the load path (llamacpp/context.py), the engine
and the repack trial all read it, and none of them may import another for it (an import circle).

Values: the worker kills itself with SIGSEGV at its first multi-token decode, "repack" only while
repacking is on, "always" in any case; "hang" and "raise": a decode of more than 100 tokens that
never returns, or that raises (context.py); "place": a slot placement that raises (engine.py);
"hang-load": a model load that never returns.
"""

CRASH_ENV = "LLMD_TEST_CRASH"
