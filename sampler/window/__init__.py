"""A window of samples: the rate series and their time-weighted summaries
(series), the timing loop that takes the samples and makes the summary one
heartbeat carries (sampler), and that summary as text for the terminal
(summary_text)."""
