"""Work that can wait: the Files and Batch API and background responses (``batches``), and
the runner that feeds their lines to the scheduler in the batch tier (``runner``).
"""
