"""What is asked and how answers are scored, for the benchmarks, training and batch runs alike.

``synthetic.py`` generates the needle tasks (RULER style), ``taskio.py`` is the task record and its LongBench JSONL
files, ``sources.py`` the named haystack texts, ``metrics.py`` the scoring (LongBench's metrics, exact match),
``longbench.py`` LongBench's prompt rules, ``cells.py`` a group of task prompts under one cache setting and their
answers. Nothing here measures or runs a benchmark (that is ``bench/``).
"""
