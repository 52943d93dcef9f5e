from trainwise import tracking


def test_scrub_drops_secret_names_and_stringifies():
    clean = tracking.scrub_params({
        "train/lr": 0.001, "aws_secret_access_key": "x", "MLFLOW_TRACKING_TOKEN": "t",
        "db_password": "p", "cloud/instance_type": "p3.2xlarge",
    })
    assert clean == {"train/lr": "0.001", "cloud/instance_type": "p3.2xlarge"}


def test_log_run_to_sqlite(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    artifact = tmp_path / "note.txt"
    artifact.write_text("hello")
    run_id = tracking.log_run(uri, tracking.RunRecord(
        experiment="t", run_name="r",
        params={"a": 1, "secret_token": "s"},
        step_metrics=[(1, {"losses/train": 2.0}), (2, {"losses/train": 1.5, "cost/usd": 0.01})],
        final_metrics={"final/eval_loss": 1.4},
        artifacts=[artifact],
    ))
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.data.params == {"a": "1"}
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "losses/train")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.5)]
    assert run.data.metrics["final/eval_loss"] == 1.4
    assert [a.path for a in client.list_artifacts(run_id)] == ["note.txt"]
