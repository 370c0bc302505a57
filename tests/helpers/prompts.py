"""Prompts the real-model tests share."""

PLAIN = [
    "The quick brown fox",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the mountains,",
]
