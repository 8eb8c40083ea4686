// Files sent with a message: picked with the Attach button, pasted into the message box or recorded
// with the microphone (a voice note, transcribed by the gateway), listed above the box until sent,
// and shown in the chat (images as pictures, other files by name).

import { $, el } from "./dom.js";

const ACCEPTED = "image/png,image/jpeg,image/gif,image/webp,application/pdf,text/plain,text/markdown,text/csv," +
  "application/json,audio/ogg,audio/mpeg,audio/wav,audio/webm,audio/mp4,.md,.markdown,.csv,.json,.txt,.docx,.xlsx," +
  ".pptx";

/** The files waiting to go with the next message. */
export class PendingFiles {
  /** `failed(text)` shows a problem to the person. */
  constructor(failed) {
    this.files = [];
    this.recorder = null;
    this.failed = failed;
    $("attach-input").accept = ACCEPTED;
    $("attach").addEventListener("click", () => $("attach-input").click());
    $("attach-input").addEventListener("change", () => {
      this.add($("attach-input").files);
      $("attach-input").value = ""; // the same file may be picked again
    });
    $("record").addEventListener("click", () => this.toggleRecording().catch((err) => {
      $("record").textContent = "Record";
      $("record").setAttribute("aria-pressed", "false");
      this.recorder = null;
      this.failed(`The microphone could not be used: ${err.message}`);
    }));
    $("message-input").addEventListener("paste", (event) => {
      const pasted = [...(event.clipboardData?.files || [])];
      if (!pasted.length) return;
      event.preventDefault(); // a pasted picture is a file, not its name as text
      this.add(pasted);
    });
  }

  /** A voice note from the microphone: the first press starts it, the second adds it to the tray. */
  async toggleRecording() {
    if (this.recorder) {
      this.recorder.stop();
      return;
    }
    if (!navigator.mediaDevices?.getUserMedia) {
      throw new Error("the browser offers no microphone to a page not served over HTTPS (or from this computer)");
    }
    const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    const recorder = new MediaRecorder(stream);
    const chunks = [];
    recorder.addEventListener("dataavailable", (event) => chunks.push(event.data));
    recorder.addEventListener("stop", () => {
      for (const track of stream.getTracks()) track.stop();
      this.recorder = null;
      $("record").textContent = "Record";
      $("record").setAttribute("aria-pressed", "false");
      const type = (recorder.mimeType || "audio/webm").split(";")[0];
      const extension = type.split("/")[1] || "webm";
      this.add([new File(chunks, `voice-note.${extension}`, { type })]);
    });
    recorder.start();
    this.recorder = recorder;
    $("record").textContent = "Stop recording";
    $("record").setAttribute("aria-pressed", "true");
  }

  add(files) {
    this.files.push(...files);
    this.render();
  }

  /** The files, each read for the native API's `attachments` (`upload`) and to show (`shown`); the
   * tray emptied. */
  async take() {
    const files = this.files;
    this.files = [];
    this.render();
    return Promise.all(files.map(async (file) => ({
      upload: { name: file.name || "pasted", media_type: file.type || undefined, data: await base64(file) },
      shown: { name: file.name || "pasted", media_type: file.type, url: async () => URL.createObjectURL(file) },
    })));
  }

  get count() {
    return this.files.length;
  }

  render() {
    const tray = $("attachments-tray");
    tray.replaceChildren();
    tray.hidden = !this.files.length;
    this.files.forEach((file, index) => {
      const chip = el("span", "file-chip", file.name || "pasted image");
      const remove = el("button", "file-remove", "×");
      remove.type = "button";
      remove.setAttribute("aria-label", `Remove ${file.name || "the pasted image"}`);
      remove.addEventListener("click", () => {
        this.files.splice(index, 1);
        this.render();
        $("message-input").focus();
      });
      chip.append(remove);
      tray.append(chip);
    });
  }
}

function base64(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(",", 2)[1] || "");
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

/** Under a message: its files (`{name, media_type, url}`, `url()` a promise of the file's address):
 * pictures shown, recordings playable, other files a link that fetches them. */
export function showFiles(box, files) {
  if (!files.length) return;
  const list = el("div", "files");
  for (const file of files) {
    const label = `${file.name || "file"} (${file.media_type || "a file"})`;
    if (file.media_type?.startsWith("image/")) {
      const image = el("img", "file-image");
      image.alt = file.name || "an image";
      image.title = label;
      file.url().then((url) => { image.src = url; }).catch(() => { image.alt = `${label}: not available`; });
      list.append(image);
    } else if (file.media_type?.startsWith("audio/") && file.url) {
      const player = el("audio", "file-audio");
      player.controls = true;
      player.title = label;
      file.url().then((url) => { player.src = url; }).catch(() => { player.replaceWith(el("span", "file-chip", label)); });
      list.append(player);
    } else if (file.url) {
      list.append(downloadLink(file, label));
    } else {
      list.append(el("span", "file-chip", label));
    }
  }
  box.append(list);
}

/** A link that fetches the file (with the key) when clicked, then saves it under its name. */
function downloadLink(file, label) {
  const link = el("a", "file-chip", label);
  link.href = "#";
  link.addEventListener("click", async (event) => {
    if (link.download) return; // fetched already: the browser saves it
    event.preventDefault();
    try {
      link.href = await file.url();
      link.download = file.name || "file";
      link.click();
    } catch {
      link.textContent = `${label}: not available`;
    }
  });
  return link;
}
