"""The hostile-input suite: every kind of repository object damaged in every way, and every command run on it.

``test_damage_matrix.py`` asserts the behaviour the library owes a damaged repository; ``tally.py`` runs the
same matrix without pytest and prints how many runs ended in each outcome.
"""
