"""Where a video's shots change: PySceneDetect's content detector (the `scenes` extra) over a downscaled pass.

Run in a probe worker (`probe.video_facts`): it decodes every frame, at a low resolution. The cuts are returned
as the start times of the frames they fall on, in the frame times `media.sample_span` counts in, so a shot's
span samples exactly its own frames.
"""

from __future__ import annotations

from ..media import frame_starts


def cut_times(path: str, threshold: float, min_s: float) -> list[float]:
    """Each cut's start time (seconds from the first frame), ascending; a shot is at least `min_s` long."""
    from scenedetect import ContentDetector, SceneManager, open_video

    video = open_video(path, backend="pyav")
    manager = SceneManager()
    manager.auto_downscale = True   # about 256 px wide: cuts show as well, at a fraction of the work
    manager.add_detector(ContentDetector(threshold=threshold,
                                         min_scene_len=max(1, round(min_s * float(video.frame_rate)))))
    manager.detect_scenes(video)
    starts = frame_starts(path)
    # To the microsecond: decord's frame times are float32 (2.5199999809 for 2.52), and a cut is a row's start_s;
    # a frame within a microsecond of a span's start counts as in it (`media.frames_in_span`).
    return [round(starts[start.frame_num], 6) for start, _ in manager.get_scene_list()[1:]
            if start.frame_num < len(starts)]
