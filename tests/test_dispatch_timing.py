from jaxinfer.engine.dispatch_timing import DispatchTiming


def test_dispatch_timing_says_when_to_chain():
    t = DispatchTiming(window=3, weight=0.5)
    assert t.chain_at(1) is None                  # nothing timed

    def run(seconds):                              # a dispatch seen to last `seconds`
        t.started()
        t.start -= seconds
        t.finished()
        t.record(1)

    t.launched(0.002)
    run(0.020)
    assert abs(t.duration(1) - 0.020) < 0.002
    t.started()
    assert abs(t.chain_at(1) - (t.start + t.duration(1) - 0.002)) < 1e-9
    assert abs(t.chain_at(1, early=0.001) - (t.start + t.duration(1) - 0.003)) < 1e-9
    assert t.chain_at(8) is None                  # another batch size: not timed yet
    t.launched(0.004)
    assert abs(t.launch - 0.003) < 1e-9
    for late in (0.025, 0.030):                    # seen late: the estimate does not follow upwards
        run(late)
    assert abs(t.duration(1) - 0.020) < 0.002
    for slower in (0.040, 0.041, 0.042):           # but a dispatch that really got slower is learnt
        run(slower)
    assert abs(t.duration(1) - 0.040) < 0.002
