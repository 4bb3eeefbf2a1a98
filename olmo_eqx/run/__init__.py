"""One run as a process and what it leaves: which platform JAX starts on (`accelerators`), huge
pages (`huge_pages`), what several processes agree on (`processes`), stop signals (`signals`),
the run dir (`run_dir`) and its lock (`lock`), metrics sinks (`sinks`), plots (`plots`) and a
sweep's summary (`sweep`). The bottom layer: it imports nothing of the library but `errors`.

Kept free of imports: `olmo_eqx/__init__.py` imports `accelerators` and `huge_pages` before JAX.
"""
