"""A rule reward for the tiny job: the share of the response's characters that are digits
(a random tiny model scores 0 on gsm8k's exact answer, and all-zero rewards make GAE trivial)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    text = solution_str or ""
    return sum(c.isdigit() for c in text) / max(len(text), 1)
