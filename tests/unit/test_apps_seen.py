from llmd.daemon.apps_seen import AppsSeen, app_name


def test_an_app_is_named_by_its_key_origin_or_user_agent():
    assert app_name({"user-agent": "Continue/1.2 (vscode)"}) == "Continue"
    assert app_name({"user-agent": "Zed/0.190", "origin": "http://localhost:3000"}) == "http://localhost:3000"
    keyed = app_name({"authorization": "Bearer sk-abc", "user-agent": "aider/1"}, token="llmd-token")
    assert keyed.startswith("key:") and "abc" not in keyed
    assert app_name({"authorization": "Bearer llmd-token", "user-agent": "llmd/0.1"}, token="llmd-token") == "llmd"
    assert app_name({}) == "(no user-agent)"
    assert app_name({"user-agent": "\x00evil\nname"}) == "?evil?name"


def test_the_summary_is_per_app_and_model_over_the_window():
    seen = AppsSeen(window_s=60)
    seen.record("Continue", "qwen-0.5b", 0.2, 30, now=0.0)
    seen.record("Continue", "qwen-0.5b", 0.3, 40, now=10.0)
    seen.record("claude-cli", "qwen-1.5b", 20.0, 9000, now=50.0, priority="agent")
    rows = seen.summary(now=65.0)  # the first is out of the window
    assert rows == [{"app": "claude-cli", "model": "qwen-1.5b", "requests": 1, "engine_s": 20.0, "tokens": 9000,
                     "priority": {"agent": 1}},
                    {"app": "Continue", "model": "qwen-0.5b", "requests": 1, "engine_s": 0.3, "tokens": 40,
                     "priority": {"interactive": 1}}]
