"""The benchmark harness: quality, speed and memory runs, their results folders, reports and plots."""
